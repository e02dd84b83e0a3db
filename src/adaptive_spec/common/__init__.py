"""Small pure helpers every feature uses: a bounded LRU map, the cache directory, the proxy's own header names."""
