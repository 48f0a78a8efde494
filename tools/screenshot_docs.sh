#!/usr/bin/env bash
# Screenshots of a built documentation site, to look at what the strict build cannot check (layout,
# navigation, rendered signatures and docstrings): index.html and one API reference page.
#   tools/screenshot_docs.sh SITE_DIR OUT_DIR [API_PAGE]   (API_PAGE defaults to api/setup.html)
# Build the site first: NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir SITE_DIR
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 SITE_DIR OUT_DIR [API_PAGE]" >&2
  exit 2
fi
site=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
api_page=${3:-api/setup.html}
chromium=${CHROMIUM:-/usr/bin/chromium}
profile=$(mktemp -d)  # a throwaway profile: no state shared with another Chromium
trap 'rm -rf "$profile"' EXIT
for page in index.html "$api_page"; do
  if [ ! -f "$site/$page" ]; then
    echo "no $site/$page: build the site first" >&2
    exit 1
  fi
  png="$out/$(echo "${page%.html}" | tr / -).png"
  timeout 120 "$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
    --window-size=1280,1600 --screenshot="$png" "file://$site/$page" >/dev/null 2>&1
  [ -s "$png" ] || { echo "chromium wrote no $png" >&2; exit 1; }
  echo "$png"
done
