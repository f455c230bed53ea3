#!/usr/bin/env bash
# Builds idemproxy's image from this checkout, pushes it, and points the
# Kubernetes manifests under deploy/kubernetes/ at it (the injector's own
# image, the image it gives sidecars, the examples):
#
#   deploy/build-image.sh registry.example.com/team/idemproxy:0.1.0
#   deploy/build-image.sh --no-build IMAGE   # only point the manifests at IMAGE
#
# Needs Docker with buildx and a registry you are logged in to (docker login).
# Then pass the same IMAGE to `idemproxy inject --image IMAGE`.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: deploy/build-image.sh [--no-build] REGISTRY/NAME:TAG"
build=true
if [ "${1:-}" = --no-build ]; then
  build=false
  shift
fi
# Exactly one image, and no other flag: `IMAGE --no-build` must not build and push.
if [ $# -ne 1 ] || [[ "$1" == -* ]]; then
  echo "build-image.sh: $usage" >&2
  exit 2
fi
image="$1"
# An image reference as registries and Kubernetes read it (so that nothing
# sed or YAML would read as syntax gets through either): a registry host
# (and port), lower-case path components, and a tag (at most 128
# characters), a digest, or both (TAG@sha256:DIGEST, the pinned form).
host='[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*(:[0-9]+)?'
component='[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*'
tag='[A-Za-z0-9_][A-Za-z0-9._-]{0,127}'
digest='@sha256:[a-f0-9]{64}'
reference="^${host}(/${component})+((:${tag})(${digest})?|(${digest}))\$"
if ! [[ "$image" =~ $reference ]]; then
  echo "build-image.sh: not an image reference REGISTRY/NAME:TAG (or @sha256:DIGEST, or TAG@sha256:DIGEST): $image" >&2
  exit 2
fi
name="${image%@*}"
if [[ "${name##*/}" == *:* ]]; then
  name="${name%:*}"
fi
if [ ${#name} -gt 255 ]; then
  echo "build-image.sh: an image name is at most 255 characters: $image" >&2
  exit 2
fi
if $build && [[ "$image" == *@* ]]; then
  echo "build-image.sh: a digest names an image already built; build and push with a tag, then pin with --no-build TAG@sha256:DIGEST" >&2
  exit 2
fi

# Every reference to the published image in the manifests, `image:` fields
# and the injector's `--image=` argument alike. None: they were pointed at
# another image by an earlier run, and this one would push an image nothing
# names (checked before building) -- unless this run pins, by its digest,
# the tag an earlier run pointed them at (the docs' second step).
named='ghcr\.io/idemproxy/idemproxy[:@][^" ,]*'
mapfile -t files < <(grep -rlE 'ghcr\.io/idemproxy/idemproxy[:@]' deploy/kubernetes || true)
if [ ${#files[@]} -eq 0 ] && ! $build && [[ "${image##*/}" == *:*@* ]]; then
  tagged="${image%@*}"
  # Whole references only: not the end of a longer name (myreg.io/... for reg.io/...).
  named="(^|[^A-Za-z0-9._/-])${tagged//./\\.}(@sha256:[a-f0-9]{64})?([^A-Za-z0-9._-]|\$)"
  mapfile -t files < <(grep -rlE "$named" deploy/kubernetes || true)
fi
if [ ${#files[@]} -eq 0 ]; then
  echo "build-image.sh: no manifest under deploy/kubernetes names ghcr.io/idemproxy/idemproxy any more (an earlier run pointed them at another image); restore them first: git checkout -- deploy/kubernetes" >&2
  exit 2
fi

if $build; then
  platforms="${PLATFORMS:-linux/amd64,linux/arm64}"
  echo "== docker buildx build --platform $platforms -t $image --push ."
  docker buildx build --platform "$platforms" -t "$image" --push .
fi

for f in "${files[@]}"; do
  if [[ "$named" == ghcr* ]]; then
    sed -i -E "s#${named}#${image}#g" "$f"
  else
    # The tag pinned: what follows the reference (a quote, an end of line) is kept.
    sed -i -E "s#${named}#\\1${image}\\3#g" "$f"
  fi
  echo "== $f now names $image"
done
echo "== done: kubectl apply -k deploy/kubernetes/injector, and idemproxy inject --image $image"
