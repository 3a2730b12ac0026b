"""Everything one policy update needs: batching, scoring, the update, the critic, SFT, and
data parallelism."""
