"""The SQLite caches (sqlite.py): validated headers (headers.py), tensors' hashes (hashes.py), and what
verified signatures said (signatures.py); each can make tensorfs faster, never make it fail."""
