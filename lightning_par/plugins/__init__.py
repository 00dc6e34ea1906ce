"""Plugins: checkpoint IO (sharded, atomic) and, later, precision."""
