"""Benchmark support: prompt tasks from real data and Hugging Face generation as the peer to compare with."""
