"""PD disaggregation transport: bytes, addresses, rooms and peers (no model, no scheduler).

Modules: `mooncake_transport` (the only mooncake import), `regions` (addresses, run coalescing), `layout`
(handshake fields), `messages` (versioned ZMQ control messages), `bootstrap` (HTTP rendezvous inside the prefill
server), `sender` (prefill side), `receiver` (decode side). Nothing is imported eagerly: `import transfer.regions`
does not load mooncake.
"""
