"""What runs beside one GPU: the replica, its engine, and the model runner."""

import os

# The engine thread runs model calls while other threads (asyncio, the engine process's messages)
# need cores too. OpenMP's workers would otherwise spin for 200 ms after every parallel region and
# hold those cores (measured on 2 cores: 16 concurrent streams decode 1.16x faster without the
# spin; a single stream is unchanged). Read by the OpenMP runtime at its first parallel region.
os.environ.setdefault("KMP_BLOCKTIME", "0")
