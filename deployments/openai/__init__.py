"""The OpenAI-compatible HTTP API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`), served by the router
deployment on Serve's HTTP proxy next to the gRPC API, through the same engine.

protocol.py: the request bodies, validated (pydantic, unknown fields refused), tool_protocol.py their tool-calling
parts; codec.py: request bodies to the engine's call and engine outputs to response bodies and stream chunks;
tools.py: tools to the chat template and forced calls to a grammar; tool_parser.py: outputs read for calls, streamed
or whole; http.py: the ASGI app and its errors.
"""
