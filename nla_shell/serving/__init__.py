"""Reading activations at scale: the activation reader, the batched corpus explainer, the HTTP server."""
