"""Features built on the rooms below: elastic snapshots (``elastic``) and ``SyncBatchNorm``."""
