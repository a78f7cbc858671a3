"""fx_passes: graph rewrites of Hugging Face MLA attention into the absorbed, cache-compressed form.

Not implemented yet (issue 4). Importing this package does nothing.
"""
