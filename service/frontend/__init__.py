"""The front-end process: HTTP (litestar), decoding and preprocessing into shared memory, and the client end of
the transport. Imports ``service.transport`` and ``service.core``; never the engine or a runtime.
"""
