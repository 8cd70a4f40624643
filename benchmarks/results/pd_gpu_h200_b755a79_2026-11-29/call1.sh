#!/usr/bin/env bash
# Kept as it ran (carry: .whl/pd1 = the first 25,000,000 bytes of the mooncake CUDA 13 wheel, `split -b 25000000`):
# the wheel and the tree exceed one call's 64 MiB together, so its first part waits in /tmp for call2.sh.
mkdir -p /tmp/pdparts && cp .whl/pd1/part_aa /tmp/pdparts/ && ls -la /tmp/pdparts
