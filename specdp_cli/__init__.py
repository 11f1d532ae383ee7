"""specdp: data-parallel speculative decoding on Hugging Face models."""

import time as _time

__version__ = "0.1.0"
IMPORTED_AT = _time.time()       # when this process first imported specdp (see launch.process_start_time)
