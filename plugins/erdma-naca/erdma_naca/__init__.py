"""erdma-naca: network-assisted collectives through software aggregation nodes (the IETF draft's in-network
aggregation, server-to-switch mode)."""
