"""Small helpers shared by every package (they import nothing else of the project).

`profiler/` keeps its own copies: its issue makes it a leaf with no project imports at all.
"""
