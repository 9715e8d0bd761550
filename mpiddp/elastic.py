"""Elastic training (docs/elastic.md): ``mpiddp.elastic.State`` snapshots, the
``ElasticSampler`` and durable writes; the code lives in ``mpiddp/torch/features/elastic.py``."""
from .torch.features.elastic import ElasticSampler, State, list_snapshots, write_durably  # noqa: F401

__all__ = ["State", "ElasticSampler", "list_snapshots", "write_durably"]
