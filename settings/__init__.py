"""The YAML config schema (schema) and the gRPC credentials of its `tls:` section (tls): read by the
router and by both worker pools. No torch here."""
