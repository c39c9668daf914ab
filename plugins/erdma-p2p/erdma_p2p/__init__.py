"""erdma-p2p: ranks behind NATs reach each other. This first part: STUN (the mapping a NAT gives the data
socket itself) and the ``stun`` traversal, which advertises that mapping and punches this rank's NAT open
towards the peers that dial it."""
