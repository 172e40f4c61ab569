"""Reading activations at scale: the activation reader, `nla explain` (one text or a corpus), the HTTP server."""
