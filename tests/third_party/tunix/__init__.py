"""Google tunix 0.1.7's NNX model files, vendored for the tests (see README.md). Apache-2.0 (LICENSE)."""
