"""HTTP route handlers: thin adapters between Litestar and the gateway services."""
