"""gpu/models"""
