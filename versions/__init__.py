"""The model registry: public model names, their versions, and which versions a name means now.

    tables.py      the registry's rows (in the tenant database; migration 0003_model_registry)
    names.py       version ids (`name@version`), states, the rules names and weights follow
    repository.py  every read and write of those rows; the alias change is a compare-and-set
    routing.py     the table a replica routes by: name -> version, split by weight, pinned per request
    sync.py        keeps every replica's table and hosted versions in step with the database
    service.py     the admin operations: register, deploy, set the alias, roll back, retire

docs/versions.md describes the whole.
"""
