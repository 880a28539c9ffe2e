"""The parts tests and benchmarks run tensorfs against, real ones, started on loopback and always
stopped (as trio.testing is trio's): not the library, and nothing of the library imports it.

    servers.py   nginx and SeaweedFS on 127.0.0.1, on free ports, their state in a directory of ours
    cluster.py   a SeaweedFS cluster (master, volume servers, filer, S3) and the caching tier in front
    nodes.py     a fleet's nodes: network namespaces, and the relay they reach the store through
    link.py      a distant, slow link on loopback (latency and a shared rate): a TCP proxy
"""
