"""From a name a user gives to a validated model: the source and what it is opened with (source.py),
a location's shards into tables (locations.py), a diffusers pipeline's components (pipelines.py), and
which files of the model's folder its view holds, and why (view_files.py)."""
