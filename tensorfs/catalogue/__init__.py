"""Which shard holds each tensor (tables.py), the rules across a model's shards (assembly.py), and the
other copies of a model a tensor may be served from (fallbacks.py)."""
