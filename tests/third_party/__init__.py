"""Code written by others, vendored for the tests. Each subdirectory has its own licence and README.md."""
