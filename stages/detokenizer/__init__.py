"""stages/detokenizer"""
