"""Algorithms on flat buffers over a communicator (ring, native MPI); no knowledge of torch."""
