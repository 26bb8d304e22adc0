"""stages/ingress"""
