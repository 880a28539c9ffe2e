"""The file system as tensorfs touches it: system calls (syscalls.py), the one writer of every file
written at a path a user gives (writer.py), and files opened where others may change them (guarded.py)."""
