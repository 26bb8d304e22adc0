"""stages/scheduler"""
