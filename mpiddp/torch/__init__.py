"""Framework glue for PyTorch: tensor collectives, the distributed optimizer, state sync."""
