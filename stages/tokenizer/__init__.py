"""stages/tokenizer"""
