"""The side-by-side peer benchmark's pieces: the cases and reference (cases.py), the peers
(adapters.py); bench/peers_bench.py runs them."""
