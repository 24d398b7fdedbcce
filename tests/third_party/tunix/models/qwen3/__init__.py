"""Vendored from google-tunix 0.1.7 (see ../README.md). Empty: tunix's own package __init__ is not copied."""
