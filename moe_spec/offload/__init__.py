"""Routed experts kept in a slower tier (a file on disk, or pinned host memory) with a resident cache."""
