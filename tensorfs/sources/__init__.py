"""Where a shard's bytes come from, behind one small interface (shard.py) that the model and the read
path use: a local file (local.py), or an object in a store (store.py: the client, URLs, requests)
read through the chunk cache (cache/) as a remote shard (remote.py). Nothing above this package
knows where bytes come from."""
