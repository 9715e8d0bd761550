"""The background coordinator: requests and handles, negotiation, fusion, execution."""
