"""Proving bytes: tensors' hashes and their verification (integrity.py), manifests (manifest.py), an
OpenSSF Model Signing signature verified (signature.py), a model held to one (signed_model.py), and a
file's bytes against it, range by range (signed_bytes.py)."""
