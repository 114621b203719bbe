"""Hold a store open for writing for N seconds (a docs helper): python3 hold.py URL SECONDS"""

import sys
import time

import hostkv_providers as hk

with hk.open(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))
