"""candidates"""
