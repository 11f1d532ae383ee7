"""(being written)"""
FAMILIES = []
