"""Between the front ends and the engine: shared-memory slots for the pixels, small typed messages for the rest.

The one room that knows shared memory; both ends live here. Imports ``service.core`` only.
"""
