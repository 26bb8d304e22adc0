"""conveyor/tiny"""
