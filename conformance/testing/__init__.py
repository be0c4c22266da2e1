"""Tools to test the conformance suite itself (a fault-injecting proxy)."""
