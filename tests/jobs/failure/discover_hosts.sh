#!/bin/sh
# Two local "hosts" with one slot each, so that Horovod elastic can blacklist the one whose worker
# failed while the other keeps training (both names resolve to this machine; no ssh is used).
echo localhost:1
echo 127.0.0.1:1
