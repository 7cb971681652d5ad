"""Request handlers, one module per domain (each exports HANDLERS: frame type → handler)."""
