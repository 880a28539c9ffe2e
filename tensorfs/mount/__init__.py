"""The mount: the FUSE tree and its handlers, the daemon and its lifecycle, and the system's mount table."""
