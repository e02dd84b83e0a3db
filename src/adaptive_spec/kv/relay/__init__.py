"""The kv-relay: a small HTTP service beside a llama-server that streams its slot files to another host, and prefills
for others.
"""
