"""export: torch.export / AOTInductor / ONNX for models that call the ``mla`` ops.

Not implemented yet (issue 6). Importing this package does nothing.
"""
