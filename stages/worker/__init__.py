"""stages/worker"""
