"""Plugins: checkpoint IO (sharded DCP, one file, atomic and checked; export and import) and precision."""
