from kvcache_ext import _C
